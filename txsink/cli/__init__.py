"""The ``txsink`` console script: commands call the library, :mod:`.output` renders."""
