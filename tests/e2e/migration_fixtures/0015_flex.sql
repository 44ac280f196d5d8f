-- Rows of 0015_flex: the finished fixture job served at a provider's flex tier.
UPDATE jobs SET dispatch_via = 'flex', dispatch_reason = 'deadline_allows_flex'
WHERE id = '0190a000-0000-7000-8000-000000000001';
