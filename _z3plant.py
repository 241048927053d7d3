import sys
from unittest import mock
import parallel.dp.zero3 as z3
import _z3check as c
from parallel.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
def planted(ps, names):
    def ensure(self, indices):   # the wait left out: reads race the gathers
        self.gather(indices)
        for i in indices:
            if self.state[i] == z3.GATHERING: self.state[i] = z3.READY
    out = {}
    with mock.patch.object(z3.ShardedParams, "ensure", ensure):
        for n in names:
            checker = c.StreamChecker()
            with checker.installed():
                t = c.Trainer(c.parse_args(c.BASE + c.BLOCKS[n]))
                try:
                    t.train()
                except Exception as e:
                    pass
            out[n] = (None, list(checker.violations))
    return out
if __name__ == "__main__":
    res = run_distributed(planted, grid=RankGrid(dp=4), args=(sys.argv[1:],), timeout_s=60, deadline_s=600)
    for k, v in res[0].items(): print(k, len(v[1]), v[1][:2])
