from rlfleet.operator.main import main

raise SystemExit(main())
