"""Tools over every format: ``describe`` (``ckptio ls`` / ``inspect``, the
listing), ``integrity`` (``ckptio.verify``), ``convert``, ``sysinfo``
(``ckptio info``), ``cli`` (the ``ckptio`` command), ``progress`` (its
progress line) and ``bench`` (``ckptio bench``'s runner)."""
