-- Schema version 4: no change of its own.
SELECT 1;
