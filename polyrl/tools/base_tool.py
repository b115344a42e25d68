"""verl's module path `verl.tools.base_tool`: porting a verl tool is `s/verl.tools/polyrl.tools/` in its imports."""

from polyrl.tools.base import BaseTool

__all__ = ["BaseTool"]
