-- Rows of 0018_fairness_lags: acme, behind the standard class's clock by its burst credit.
INSERT INTO fairness_lags (class, tenant, lag, updated_at)
VALUES ('standard', 'acme', 2730.5, '2026-12-05T00:00:00Z');
