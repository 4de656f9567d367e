"""Early refusal: a request no replica is predicted to serve within the service's latency objectives
is answered at once (503 with retry-after) instead of waiting in a queue it cannot leave in time.
Pure: the predictions come from ``ClusterState`` (``predicted_ttft``, ``predicted_tbt``)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class SloRefusal:
    """``ttft_s``: the first token's deadline (``--ttft-slo``); ``tbt_s``: the most time between two
    tokens once the request decodes (``--tbt-slo``); None: no such objective."""

    ttft_s: float | None = None
    tbt_s: float | None = None

    def why(self, ttft: dict[str, float], tbt: dict[str, float]) -> str | None:
        """Why a request is refused, given each replica's predicted TTFT and time between tokens
        (seconds; a replica missing from one has no prediction there, and is taken to meet it);
        None: some replica meets every objective set, or no replica is predicted at all."""
        replicas = set(ttft) | set(tbt)
        if not replicas or any(self._meets(r, ttft, tbt) for r in replicas):
            return None
        if self.ttft_s is not None and ttft and min(ttft.values()) > self.ttft_s:
            return (f"every replica would give the first token later than the --ttft-slo of {self.ttft_s:g} s "
                    f"(the soonest in {min(ttft.values()):.2f} s, at the prefill queued on it)")
        if self.tbt_s is not None and tbt and min(tbt.values()) > self.tbt_s:
            return (f"every replica would take longer than the --tbt-slo of {self.tbt_s:g} s between tokens "
                    f"(the least {min(tbt.values()):.2f} s: a decode step and the prefill chunk run between two)")
        return (f"no replica would meet both the --ttft-slo of {self.ttft_s:g} s and the --tbt-slo of "
                f"{self.tbt_s:g} s: those soon enough to answer decode too slowly, and the others answer too late")

    def _meets(self, replica: str, ttft: dict[str, float], tbt: dict[str, float]) -> bool:
        in_time = self.ttft_s is None or ttft.get(replica, 0.0) <= self.ttft_s
        return in_time and (self.tbt_s is None or tbt.get(replica, 0.0) <= self.tbt_s)

    @property
    def active(self) -> bool:
        return self.ttft_s is not None or self.tbt_s is not None
