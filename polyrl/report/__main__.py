import sys

from polyrl.report.page import main

sys.exit(main())
