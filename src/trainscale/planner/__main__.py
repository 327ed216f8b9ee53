"""``python -m trainscale.planner``: the command line (:mod:`trainscale.planner.cli`)."""

if __name__ == "__main__":
    from trainscale.planner.cli import main

    raise SystemExit(main())
