from labbook.grader.cli import main

raise SystemExit(main())
