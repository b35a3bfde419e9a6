"""On PYTHONPATH, makes `import torch` fail and transformers believe torch is absent, as on a base install."""

import sys

sys.modules["torch"] = None
