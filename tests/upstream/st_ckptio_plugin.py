"""pytest plugin (``-p st_ckptio_plugin``) for safetensors' own test suite: points
``safetensors.torch``'s functions at ``ckptio.safetensors`` before the tests import them.

safetensors' ``load_model`` / ``save_model`` stay the package's own and call the patched
``load_file`` / ``save_file`` through their module, as a user's code would.
"""

import ckptio.safetensors as _cst
import safetensors.torch as _st

for _name in ("save_file", "load_file", "save", "load"):
    setattr(_st, _name, getattr(_cst, _name))
