"""channels.py's store calls that the store does not answer (in process, a store that hangs)."""

import logging
import threading

from slackswap_ds.channels import StructureLedger


class HangingStore:
    """A store whose host stopped answering: every call waits until `release` is set."""

    def __init__(self):
        self.release = threading.Event()

    def set(self, key, value):
        self.release.wait()

    def check(self, keys):
        self.release.wait()
        return False


def test_a_ledger_whose_store_stops_answering_says_so_once_and_never_waits_again(caplog, monkeypatch):
    """Issue 35 (a rank aborted after a finished job): a call the store does not answer is left on
    the ledger's thread, and a process exiting while a thread waits inside a TCPStore call ends by
    SIGABRT. The ledger went silent without a word; now it says so once, naming the consequence,
    and later publishes return at once."""
    monkeypatch.setattr(StructureLedger, "silence_s", 0.05)
    store = HangingStore()
    ledger = StructureLedger(store=store, rank=1, world=2, prefix="t")
    try:
        with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
            assert ledger.publish("(2, 16)", "abc") == {}
            assert ledger.publish("(2, 24)", "def") == {}
        said = [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("slackswap rank 1: the torch.distributed store did not answer "
                                                     "for 0.05 s") and "SIGABRT" in said[0]
    finally:
        store.release.set()
