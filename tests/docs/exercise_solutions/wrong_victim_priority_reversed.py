"""Wrong: takes a larger priority value as MORE important."""


def choose_victim(running, policy="fcfs"):
    if policy == "priority":
        return min(running, key=lambda r: (r["priority"], -r["arrival"]))["id"]
    return max(running, key=lambda r: (r["admitted"], r["arrival"]))["id"]
