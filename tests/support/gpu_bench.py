"""bench/gpu_compile.py as a module for the GPU-compile tests. The bench imports its siblings by
plain name (`harness`, `models`), as every bench does; they are loaded for it and then taken out of
`sys.modules` again, so that a plain `models` or `harness` imported later is never the bench's."""
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
SIBLINGS = ("harness", "models")


def _load():
    saved = {name: sys.modules.pop(name) for name in SIBLINGS if name in sys.modules}
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_gpu_compile", BENCH / "gpu_compile.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module          # its Flax modules are dataclasses, which look it up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))
        for name in SIBLINGS:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


gpu_compile = _load()
