import time, statistics, sys
from beamrl.rewards import RewardComponentConfig, RewardManager, RewardPoolConfig, RewardSample
def main():
    comps=[RewardComponentConfig(name="exact", fn="beamrl.rewards.exact:exact_match", weight=1.0, timeout_s=10)]
    samples=[RewardSample(prompt=f"{i%10}+{i%7}=", completion=str(i%13), completion_ids=[1,2,3], prompt_ids=[4,5,6,7], ground_truth=str(i%11), data_source="add", metadata={}) for i in range(64)]
    with RewardManager(comps, RewardPoolConfig(batch_timeout_s=60)) as rm:
        rm.wait_ready()
        print("workers", rm.plans[0].num_workers)
        for _ in range(5): rm.score(samples)
        cpu=[];wall=[]
        for _ in range(40):
            t0,c0=time.perf_counter(),time.thread_time()
            rm.score(samples)
            wall.append(time.perf_counter()-t0); cpu.append(time.thread_time()-c0)
    print(f"score(64): driver CPU median {statistics.median(cpu)*1e3:.2f} ms, wall median {statistics.median(wall)*1e3:.2f} ms")
if __name__=="__main__": main()
