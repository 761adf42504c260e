from qrun.server.command import main

raise SystemExit(main())
