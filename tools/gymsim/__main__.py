from tools.gymsim.launcher import main

raise SystemExit(main())
