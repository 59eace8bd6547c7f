"""tightfit's kernels by backend: ``cpu/`` holds the native CPU kernels' C sources (:mod:`tightfit.kernels.sources`
reads them; :mod:`tightfit.cuda.native` builds them on first use). The Python launchers, references and the
dispatcher are in :mod:`tightfit.cuda`."""
