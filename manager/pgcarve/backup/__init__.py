"""Backups, WAL archiving and the recoverable window of each instance.

`pgbackrest` is the one module that knows the backup tool (its configuration file, its command
lines, its `info` output); `catalog` holds the tool-neutral types the rest of pgcarve uses. A
change of tool (Barman, WAL-G) touches that module and the image only.
"""
