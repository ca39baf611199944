-- A real-program workload for scripts/bench.sh: inserts, an index, joins, sorting.
CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL, grp INTEGER);
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 200000)
INSERT INTO t SELECT x, printf('name-%d-%s', x, hex(randomblob(8))), x * 0.5, x % 97 FROM c;
CREATE INDEX t_name ON t(name);
CREATE TABLE g AS SELECT grp, count(*) AS n, avg(v) AS mean, group_concat(substr(name, 1, 8)) AS names FROM t GROUP BY grp;
SELECT count(*), sum(length(names)) FROM g;
SELECT count(*) FROM t JOIN g ON t.grp = g.grp WHERE t.v > g.mean;
SELECT name FROM t ORDER BY name DESC LIMIT 3;
