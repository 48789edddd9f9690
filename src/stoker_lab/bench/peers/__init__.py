"""`stoker bench peers`: stoker against the loaders people use, in one run.

:mod:`.bench` orchestrates (sample data, conversions, the emulated origin, one subprocess per
loader), :mod:`.report` prints the table, checks the targets and draws the plot, and each
``run_<loader>.py`` is a small script run by the loader's own Python (stoker's, or a peer's
virtual environment from :mod:`stoker_lab.bench.venvs`) that converts the data with the peer's
tool or reads it for some epochs, printing one JSON line per epoch (:mod:`._runner`).
"""
