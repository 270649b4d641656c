#!/bin/sh
# Run once by Patroni on the first primary, after initdb: the gateway's own role and database
# (it creates and migrates its schema itself at start). The password is FENCE_PG_PASSWORD.
set -eu
psql -v ON_ERROR_STOP=1 -d postgres <<SQL
CREATE ROLE fence LOGIN PASSWORD '${FENCE_PG_PASSWORD}';
CREATE DATABASE fence_gateway OWNER fence;
SQL
