-- Forecasts at submission: when a job (and a batch, for all its lines) was expected to
-- finish, p50 and p90. Kept on the row so that the forecast is shown with the job and
-- measured against when it really finished.
ALTER TABLE jobs ADD COLUMN eta_p50 timestamptz, ADD COLUMN eta_p90 timestamptz;
ALTER TABLE batches ADD COLUMN eta_p50 timestamptz, ADD COLUMN eta_p90 timestamptz;
-- The forecasts measured: finished jobs that carried one, by when they finished.
CREATE INDEX jobs_forecast_finished ON jobs (finished_at) WHERE eta_p50 IS NOT NULL;
