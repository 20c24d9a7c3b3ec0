from mlxq.cli import main

raise SystemExit(main())
