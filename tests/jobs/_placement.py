"""What a process reports about where it runs (``jobs.cluster.where``), for tests."""


def where_info(address: str, metrics: tuple[str, int] | None) -> dict:
    return {"node_id": f"node-{address}", "address": address, "hostname": "h", "pid": 1,
            "metrics": list(metrics) if metrics else None, "ifnames": {}}
