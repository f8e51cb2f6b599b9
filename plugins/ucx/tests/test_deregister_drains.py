"""ucx's deregister and same-host peers' cma copies.  cma copies with
process_vm_readv/writev and ignores remote keys, so unmapping memory does
not stop a same-host peer's copy already under way; deregister must wait for
it (kvt.epoch), as the host backend's does.  The conformance suite runs its
deregister test only for owner_check="server" backends, so on ucx it was
skipped; this runs the owner-check suite on ucx declared "server" (nothing
else changed), over cma.  Before the fix, READs brought back the bytes the
owner wrote the instant deregister returned, and WRITEs landed on them."""

import kvt_conformance as kc
import msgspec
from kvt_ucx import UcxBackend


class UcxDeclaredServer(UcxBackend):
    """ucx, declared owner_check="server" only so that the suite's deregister test runs."""

    capabilities = msgspec.structs.replace(UcxBackend.capabilities, owner_check="server")


class TestDeregisterWaitsForCma(kc.OwnerCheckTests):
    backend_target = UcxDeclaredServer
    backend_options = {"timeout": 5.0, "ucx": {"NET_DEVICES": "lo"}}
