"""EpRouted's private parts, for tests and benchmarks only: each helper bypasses EpRouted's
validation (argument checks, the dispatch/combine pairing, the step bookkeeping), so what it
returns can break the contract the public calls keep. No library module imports this one.

`transport(routed)`: the transport EpRouted drives (a benchmark of one phase alone calls its
dispatch or combine directly). `buffers(routed)`: its symmetric buffers, whose receive rows and
expert output rows a test poisons before a call or whose layout it measures.
"""

from __future__ import annotations

from dep_ep.comm.buffers import EpBuffers
from dep_ep.comm.transport import Transport
from dep_ep.ep import EpRouted


def transport(routed: EpRouted) -> Transport:
    """The transport of `routed`: its calls skip EpRouted's validation and pairing."""
    return routed._transport


def buffers(routed: EpRouted) -> EpBuffers:
    """The symmetric buffers of `routed`, peer views included: writes bypass EpRouted's checks."""
    return routed._buffers
