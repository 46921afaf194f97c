"""HiGHS's output kept off the process's descriptors (planners/solver_output.py), also while two
solves run in two threads (the default planner's two searches, planners/refine.py)."""

import os
import threading

from slackswap_ds.planners.solver_output import solver_output_dropped


def test_solves_in_two_threads_give_the_process_its_output_back(capfd):
    """The default planner's two searches run in two threads (planners/refine.py), each solve with the
    process's stdout and stderr sent to a temporary file: interleaved (A starts, B starts, A ends, B
    ends), they leave both where they were, and what either thread wrote meanwhile still reaches
    stderr. (Each solve restoring the descriptors it had found, a job once printed nothing after its
    first plan: its output went into A's deleted file.)"""

    def where():
        return tuple((os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2))

    before = where()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a():
        with solver_output_dropped():
            a_in.set()
            b_in.wait(5)
            os.write(1, b"written during A\n")
        a_out.set()

    def b():
        a_in.wait(5)
        with solver_output_dropped():
            b_in.set()
            a_out.wait(5)
            os.write(2, b"written during B\n")

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert where() == before
    os.write(1, b"the job's next line\n")
    cap = capfd.readouterr()
    assert cap.out == "the job's next line\n"
    assert sorted(cap.err.splitlines()) == ["written during A", "written during B"]
