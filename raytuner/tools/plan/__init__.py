"""`raytuner plan`: a job's GPU memory per training worker, encoder actor and validation actor,
traced on the meta device.

``measure.py`` puts the figures together (``measure``: what ``raytuner.plan`` returns);
``trace.py`` traces each setting once, counted by ``meta.py``'s byte counter (``vae.py``: the
encoder actor's VAE encode, a long clip's from a few chunks); ``fsdp.py`` the sharded worker;
``suggest.py`` the settings to try; ``report.py`` what the command prints (and ``--gpu-memory``,
whose parser is ``config/sizes.py``), ``progress.py`` its lines on stderr.
``report.py`` and ``progress.py`` import no torch: the CLI and the API load them before
planning starts. ``auto.py`` decides ``scaling.strategy = "auto"`` on those traces and
``adopt.py`` applies it and the step's settings to a run before its workers start.
"""
