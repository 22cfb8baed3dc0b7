"""Markers for the processes a test starts and then looks for machine-wide (pgrep, /proc): unique to
this pytest process, also beside another one running at the same time. Fixed width, so that no
process's marker is a prefix of another's."""

import os

#: This pytest process's own digits; a test appends its own after them.
PROCESS = f"{os.getpid():07d}"
