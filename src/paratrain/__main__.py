from paratrain.cli import main

raise SystemExit(main())
