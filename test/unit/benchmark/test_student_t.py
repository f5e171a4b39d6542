"""Student's t quantiles computed without scipy, against closed forms and published tables."""

from __future__ import annotations

import math

import pytest

from lightllm.benchmark.student_t import regularized_incomplete_beta, student_t_cdf, student_t_quantile

# Two-sided 95% critical values t_{df, 0.975}, as printed (to three decimals) in standard tables.
TABLE_975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
    20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
    29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
}
# Other levels from the same tables: (p, df) -> t.
TABLE_OTHER = {(0.95, 1): 6.314, (0.95, 10): 1.812, (0.99, 5): 3.365, (0.995, 2): 9.925, (0.995, 20): 2.845,
               (0.9995, 3): 12.924, (0.9, 30): 1.310}


@pytest.mark.parametrize("df", sorted(TABLE_975))
def test_the_975_quantile_matches_the_table(df):
    assert student_t_quantile(0.975, df) == pytest.approx(TABLE_975[df], abs=6e-4)


@pytest.mark.parametrize(("p", "df"), sorted(TABLE_OTHER))
def test_other_levels_match_the_table(p, df):
    assert student_t_quantile(p, df) == pytest.approx(TABLE_OTHER[(p, df)], abs=6e-4)


@pytest.mark.parametrize("p", [0.6, 0.75, 0.9, 0.975, 0.999, 0.999999])
def test_closed_forms_for_one_and_two_degrees_of_freedom(p):
    # df = 1 is the Cauchy distribution; df = 2 has t = (2p - 1) / sqrt(2 p (1 - p)).
    assert student_t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert student_t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)


def test_many_degrees_of_freedom_approach_the_normal_quantile():
    assert student_t_quantile(0.975, 1_000_000) == pytest.approx(1.959964, abs=1e-5)


def test_quantile_is_symmetric_and_inverts_the_cdf():
    for df in (1, 3, 7.5, 40):
        for p in (0.01, 0.3, 0.5, 0.8, 0.99):
            t = student_t_quantile(p, df)
            assert student_t_cdf(t, df) == pytest.approx(p, abs=1e-12)
            assert student_t_quantile(1 - p, df) == pytest.approx(-t, abs=1e-9)


def test_against_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 9, 29, 31, 100):
        for p in (0.55, 0.9, 0.975, 0.995, 0.9999):
            assert student_t_quantile(p, df) == pytest.approx(float(stats.t.ppf(p, df)), rel=1e-9)


def test_incomplete_beta_edges_and_a_known_value():
    assert regularized_incomplete_beta(2.0, 3.0, 0.0) == 0.0
    assert regularized_incomplete_beta(2.0, 3.0, 1.0) == 1.0
    # I_x(1, 1) = x; I_x(2, 1) = x^2.
    assert regularized_incomplete_beta(1.0, 1.0, 0.37) == pytest.approx(0.37, rel=1e-12)
    assert regularized_incomplete_beta(2.0, 1.0, 0.6) == pytest.approx(0.36, rel=1e-12)


@pytest.mark.parametrize(("p", "df"), [(0.0, 3), (1.0, 3), (0.5, 0), (0.9, -1), (0.9, float("inf")), (0.9, True)])
def test_bad_arguments_are_refused(p, df):
    with pytest.raises(ValueError):
        student_t_quantile(p, df)
