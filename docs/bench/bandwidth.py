"""Device memory bandwidth: a large device-to-device copy, bytes read plus written."""
import torch


def copy_rate() -> float:
    """Bytes a second, read plus written: the median of 20 copies of 2 GiB."""
    x = torch.randn(1 << 30, device="cuda", dtype=torch.float16)  # 2 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * x.numel() * x.element_size() / sorted(times)[len(times) // 2]


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}: {copy_rate() / 1e12:.2f} TB/s "
          f"(median of 20 copies of 2 GiB)")
