// Loaded on pages with widgets, after require.js and before the widget manager.
(function () {
  // The widget manager (vendor/html-manager/embed-amd.js) asks require.js for its
  // fonts under the module name "@jupyter-widgets/html-manager/dist", which would
  // resolve next to the page. Point that name at the local copy instead, relative
  // to this script, so every page, at any depth, loads them from this site.
  var here = document.currentScript.src.replace(/book\/widgets-config\.js(\?.*)?$/, "");
  require.config({
    paths: { "@jupyter-widgets/html-manager/dist": here + "vendor/html-manager" },
  });

  // A slider's handle is what keyboard and screen-reader users reach, but the
  // widget labels it only visually. Give each handle its label's text as its
  // accessible name once the widgets have rendered.
  function nameSliders() {
    document.querySelectorAll(".widget-slider").forEach(function (slider) {
      var label = slider.querySelector(".widget-label");
      var handle = slider.querySelector('[role="slider"]');
      if (label && handle && !handle.hasAttribute("aria-label")) {
        handle.setAttribute("aria-label", label.textContent.trim());
      }
    });
  }
  new MutationObserver(nameSliders).observe(document.documentElement, {
    childList: true,
    subtree: true,
  });
})();
