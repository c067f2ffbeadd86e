"""Wrong: preempts the newest ARRIVAL instead of the newest admission."""


def choose_victim(running, policy="fcfs"):
    if policy == "priority":
        return max(running, key=lambda r: (r["priority"], r["arrival"]))["id"]
    return max(running, key=lambda r: r["arrival"])["id"]
