"""runtime: DAG -> Plan scheduling, the deadlock dry run, and Ray workers that execute Plans."""
