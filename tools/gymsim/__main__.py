from quiesce.tools.gymsim.launcher import main

raise SystemExit(main())
