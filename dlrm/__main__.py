"""``python -m dlrm`` (and ``torchrun -m dlrm``, which starts each rank as ``python -u -m dlrm``).

Our sibling packages have common names (``data``, ``embeddings``), and ``-m`` puts the
current directory first on ``sys.path``: a user's own ``data.py`` or ``data/`` there
would be imported in place of ours. So, before anything of ours is imported, the current
directory's entry goes, and the siblings are found where this ``dlrm`` was found:

    regular install     site-packages is on sys.path already: the entry is just dropped
                        (moving site-packages to the front would let it shadow the stdlib)
    editable install    setuptools' finder maps dlrm/data/embeddings to the checkout, whose
    (pip install -e .)  root is not on sys.path: the entry is replaced by that root
    run in the checkout the current directory is dlrm's parent: left as it is

``dlrm/__init__.py`` imports nothing, so nothing of ours is loaded before this runs. The
``dlrm`` console script needs none of it: it puts its bin directory first, not the
current one.
"""

import os
import sys


def _our_packages_first() -> None:
    """Take the current directory that ``-m`` put at ``sys.path[0]`` off the search path."""
    if sys.flags.safe_path or not sys.path:  # python -P: nothing was prepended
        return
    cwd = os.getcwd()
    if os.path.abspath(sys.path[0] or os.curdir) != cwd:
        return
    home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds dlrm/
    if home == cwd:
        return
    if any(os.path.abspath(p or os.curdir) == home for p in sys.path[1:]):
        del sys.path[0]
    else:
        sys.path[0] = home


_our_packages_first()

from dlrm.cli import main  # after the sys.path fix, on purpose

sys.exit(main())
