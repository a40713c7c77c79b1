"""The channels the reward traffic's images travel on (layout.reward_transport), beside the
requests, scores and messages that always go over gloo (hpcnft.distributed.reward_service).

`HostImages`: copied to the host and sent over gloo with the request. `DeviceImages`: sent from
GPU to GPU on an NCCL communicator per train/reward pair. The reward rank posts the NCCL receive
only once the request's header has come over gloo, so the send it matches is already posted: no
receive ever waits on the device for a request that has not been made."""
from __future__ import annotations

import torch
import torch.distributed as dist

PAYLOAD_TAG = 2  # gloo matches receives by tag (the request's header: 1, the reply: 3)


class HostImages:
    """The images over gloo: copied to the host (which waits for their decode), tag-matched."""

    name = "gloo"

    def __init__(self, group):
        self.group = group

    def isend(self, images: torch.Tensor, dst: int) -> tuple[object, torch.Tensor]:
        imgs = images.cpu().contiguous()  # waits for the decode of this chunk only
        return dist.isend(imgs, dst, group=self.group, tag=PAYLOAD_TAG), imgs

    def recv(self, shape: tuple[int, ...], src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.uint8)
        dist.recv(t, src, group=self.group, tag=PAYLOAD_TAG)
        return t


class DeviceImages:
    """The images over NCCL, from device to device, on the communicator of each train/reward pair
    (`groups`: by the peer's rank). Only images travel on it, in order, so no tags are needed. The
    send is queued behind the decode on the GPU and the train rank goes on at once; the reward
    rank's receive is posted only after the request's header came over gloo, and the terms read
    the images where they landed (on the reward rank's GPU)."""

    name = "nccl"

    def __init__(self, groups: dict[int, object], device: torch.device):
        self.groups, self.device = groups, device

    def isend(self, images: torch.Tensor, dst: int) -> tuple[object, torch.Tensor]:
        imgs = images.to(self.device).contiguous()
        return dist.isend(imgs, dst, group=self.groups[dst]), imgs

    def recv(self, shape: tuple[int, ...], src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.uint8, device=self.device)
        dist.recv(t, src, group=self.groups[src])
        return t

    def connect(self, train_ranks: list[int], rank: int) -> None:
        """One byte over each pair, at the start: NCCL joins a pair's two ranks on its first send
        and receive, and the send blocks its host thread until the receive comes. Joined here,
        in the train ranks' order, no send of the run waits for it."""
        one = torch.zeros(1, dtype=torch.uint8, device=self.device)
        for t in train_ranks:
            if t == rank:  # a train rank: its one reward rank
                (peer, group), = self.groups.items()
                dist.send(one, peer, group=group)
            elif t in self.groups:  # a reward rank: each of its train ranks in turn
                dist.recv(one, t, group=self.groups[t])


def image_channel(topo) -> HostImages | DeviceImages:
    """The images' channel of this rank's reward traffic (layout.reward_transport, resolved)."""
    if topo.reward_transport == "nccl":
        channel = DeviceImages(topo.pair_groups, topo.device)
        channel.connect(topo.train_ranks, topo.rank)
        return channel
    return HostImages(topo.host_group)
