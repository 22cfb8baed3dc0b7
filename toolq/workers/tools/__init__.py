"""The built-in tools. Importing this package registers each of them in `toolq.core.catalog.CATALOG`."""

from toolq.core import catalog

catalog.CHECKED_PACKAGES.add(__name__ + ".")  # before the tools declare themselves (see there)

from toolq.workers.tools import (  # noqa: E402, F401
    apply_patch,
    exec_command,
    front_door,
    grep_files,
    list_dir,
    read_file,
    tool_search,
    update_plan,
    view_image,
    write_stdin,
)
