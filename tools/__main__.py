from tools.cli.main import main

raise SystemExit(main())
