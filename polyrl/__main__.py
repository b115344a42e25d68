import sys

from polyrl.cli import main
from polyrl.distributed.launch import exit_child

exit_child(main())
