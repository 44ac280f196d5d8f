-- How far each (class, tenant) queue is behind its class's clock in the leading gate's fair
-- queuing (virtual time: estimated tokens per unit of weight; negative when ahead),
-- rewritten by the leading gate about once a second. Forecasts at submission read it: a
-- tenant behind the clock is served before the others until it catches up.
CREATE TABLE fairness_lags (
    class      job_class   NOT NULL,
    tenant     text        NOT NULL,
    lag        float8      NOT NULL,
    updated_at timestamptz NOT NULL,
    CONSTRAINT fairness_lags_pkey PRIMARY KEY (class, tenant)
);
