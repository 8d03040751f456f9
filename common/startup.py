"""The first import of every entry script, before its heavy ones (torch takes seconds to import): from here on,
a Ctrl-C before the script's main runs (while those modules load) ends the process with one `interrupted`
line, as one during main does (common/errors.py), instead of a traceback from each process."""

from common.errors import one_line_interrupts

one_line_interrupts()
