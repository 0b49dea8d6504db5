"""A source checkout used without installing (PYTHONPATH=<repo>): the top-level ``epilogues/`` as ``igemm.epilogues``."""


def load_epilogues() -> None:
    """In a source checkout used without installing (PYTHONPATH=<repo>), load the top-level ``epilogues/``
    as ``igemm.epilogues``, which an install makes it; nothing else of the repository root is importable."""
    import importlib.util
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    init = os.path.join(os.path.dirname(here), "epilogues", "__init__.py")
    installed = os.path.isfile(os.path.join(here, "epilogues", "__init__.py"))
    if installed or not os.path.isfile(init) or "igemm.epilogues" in sys.modules:
        return                                          # installed (or already loaded)
    spec = importlib.util.spec_from_file_location("igemm.epilogues", init,
                                                  submodule_search_locations=[os.path.dirname(init)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["igemm.epilogues"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["igemm.epilogues"]
        raise
