"""Reading collectives out of compiled HLO text: the parser is whalex.jaxpr.hlo (bench/ reads it too);
the tests read each collective as (op, [(dtype, shape), ...])."""
from whalex.jaxpr import hlo
from whalex.jaxpr.hlo import shapes_of  # noqa: F401  (the tests import it from here)


def collectives(hlo_text: str):
    """[(op, [(dtype, shape), ...])] for every collective instruction (an async one counted once)."""
    return [(c.kind, list(c.arrays)) for c in hlo.collectives(hlo_text)]
