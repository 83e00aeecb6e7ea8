"""The straggler rule on gathered numbers (no processes): which rank, which phase, and when to stay quiet.
The real 2-rank case (a rank sleeping in its data loading) is in test_trainer_features."""

from lockstep.train.stragglers import find_straggler, straggler_line


def _rank(data_s, compute_s, comm_s, steps=100):
    return {"data_s": data_s, "compute_s": compute_s, "comm_s": comm_s, "step_s": data_s + compute_s + comm_s,
            "steps": steps}


def test_slow_compute_on_one_of_four_ranks_is_named():
    ranks = [_rank(0.2, 1.0, 3.0), _rank(0.2, 1.0, 3.0), _rank(0.2, 4.0, 0.1), _rank(0.2, 1.0, 3.0)]
    found = find_straggler(ranks)
    assert found["rank"] == 2 and found["cause"] == "compute"
    assert straggler_line(4, found).startswith("epoch 4: straggler rank 2 made the others wait 29 ms per step")


def test_balanced_ranks_and_small_waits_say_nothing():
    assert find_straggler([_rank(0.2, 1.4, 0.5), _rank(0.2, 1.45, 0.45)]) is None  # 0.5 ms of a 21 ms step
    assert find_straggler([_rank(0.2, 1.4, 0.5)]) is None  # one rank waits for nobody


def test_a_wait_its_own_phases_do_not_explain_is_communication():
    found = find_straggler([_rank(0.2, 1.4, 1.4), _rank(0.2, 1.4, 2.5)])
    assert found["rank"] == 0 and found["cause"] == "communication"
    assert "communication or between steps, not to data loading or compute" in straggler_line(1, found)


def test_a_short_step_prints_tenths_so_the_phases_it_names_differ():
    # A 3 ms step: whole milliseconds read "compute (3 ms per step; the others 3 ms)" for a rank 0.6 ms slower.
    found = find_straggler([_rank(0.01, 0.34, 0.01), _rank(0.01, 0.28, 0.07)])
    assert found["rank"] == 0 and found["cause"] == "compute"
    line = straggler_line(2, found)
    assert "made the others wait 0.6 ms per step (17% of the step)" in line, line
    assert line.endswith("its time went to compute (3.4 ms per step; the others 2.8 ms)"), line
