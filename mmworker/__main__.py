from mmworker.cli import main

raise SystemExit(main())
