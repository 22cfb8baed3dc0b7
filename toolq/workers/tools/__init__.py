"""The built-in tools. Importing this package registers each of them in `toolq.workers.catalog.CATALOG`."""

from toolq.workers.tools import (  # noqa: F401
    apply_patch,
    exec_command,
    grep_files,
    list_dir,
    read_file,
    tool_search,
    update_plan,
    view_image,
    write_stdin,
)
