from rlfleet.observability.dashboards import main

raise SystemExit(main())
