"""stoker's lab: what measures, emulates and models stoker, beside the product package.

Nothing here is needed to train with stoker. The lab imports :mod:`stoker`; :mod:`stoker` never
imports the lab (``tests/test_layers.py`` keeps it so).

- :mod:`stoker_lab.bench`: benchmarks, the demo, emulated S3 origins (moto behind a throttle),
  the fault proxy and the network-namespace cluster harness;
- :mod:`stoker_lab.sim`: the discrete-event cluster model behind ``stoker simulate``;
- :mod:`stoker_lab.sample_data`: the embedded real-photo dataset the demo and benchmarks make;
- :mod:`stoker_lab.cli`: the ``stoker`` commands above (``demo``, ``origin-server``,
  ``sample-data``, ``bench``, ``simulate``), added to the ``stoker`` command through the
  ``stoker.commands`` entry-point group (``pyproject.toml``);
- :mod:`stoker_lab.errors`: the lab's own errors.

Install its dependencies with the ``lab`` extra: ``pip install -e '.[lab]'``.
"""
