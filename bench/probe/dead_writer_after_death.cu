// Probe: once a killed process is seen dead (its /proc state is Z, as Baton's liveness
// sees it), can GPU work it queued still write into memory of ours it maps? A child maps
// our word (legacy IPC), queues on one stream either a spin kernel (SPIN ms) or a wait on
// its own memory that nothing satisfies, and behind it a cuStreamWriteValue64 of 42 into
// our word; we SIGKILL it, wait for Z, write 7, then watch the word for 3 s.
// Build: nvcc -O2 -o /tmp/w dead_writer_after_death.cu -lcuda; run: /tmp/w spin 1500; /tmp/w wait
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <unistd.h>
#include <sys/wait.h>
#include <time.h>
static double now(void){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec + t.tv_nsec*1e-9; }
__global__ void spin(long long cycles){ long long t = clock64(); while (clock64() - t < cycles) {} }
static char state(pid_t p){ char path[64], buf[512]; snprintf(path, 64, "/proc/%d/stat", p); FILE* f = fopen(path, "r"); if (!f) return '?'; size_t n = fread(buf, 1, 511, f); fclose(f); buf[n] = 0; char* r = strrchr(buf, ')'); return r ? r[2] : '?'; }
int main(int argc, char** argv){
  int waitmode = argc > 1 && !strcmp(argv[1], "wait");
  int ms = argc > 2 ? atoi(argv[2]) : 1500;
  cudaSetDevice(0); cudaFree(0);
  unsigned long long* word; cudaMalloc(&word, 64); cudaMemset(word, 0, 64);
  cudaIpcMemHandle_t h; cudaIpcGetMemHandle(&h, word);
  int clk; cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  int p[2], q[2]; pipe(p); pipe(q);
  pid_t c = fork();
  if (c == 0) {
    cudaSetDevice(0); void* m; cudaIpcOpenMemHandle(&m, h, cudaIpcMemLazyEnablePeerAccess);
    unsigned long long* own; cudaMalloc(&own, 64); cudaMemset(own, 0, 64); cudaDeviceSynchronize();
    cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (waitmode) cuStreamWaitValue64((CUstream)s, (CUdeviceptr)own, 1, CU_STREAM_WAIT_VALUE_GEQ);
    else spin<<<1, 1, 0, s>>>((long long)ms * clk);  // clk in kHz: ms * kHz = cycles
    cuStreamWriteValue64((CUstream)s, (CUdeviceptr)m, 42, 0);
    char x = 1; write(q[1], &x, 1); pause(); _exit(0);
  }
  char x; read(q[0], &x, 1); usleep(100000);
  double tk = now(); kill(c, SIGKILL);
  while (state(c) != 'Z') usleep(50);
  double tz = now();
  printf("%s: child seen Z %.2f ms after SIGKILL\n", waitmode ? "wait" : "spin", (tz - tk) * 1e3);
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cuStreamWriteValue64((CUstream)s, (CUdeviceptr)word, 7, 0); cudaStreamSynchronize(s);
  unsigned long long v = 0, last = 7; double t0 = now(); int asked = 0;
  while (now() - t0 < 3.0) {
    if (!asked && now() - t0 > 0.3) { asked = 1; printf("compute apps at +300 ms: "); fflush(stdout); system("nvidia-smi --query-compute-apps=pid --format=csv,noheader | tr '\\n' ' '; echo"); }
    cudaMemcpyAsync(&v, word, 8, cudaMemcpyDeviceToHost, s); cudaStreamSynchronize(s);
    if (v != last) { printf("word changed to %llu %.1f ms after the child was seen dead\n", v, (now() - tz) * 1e3); last = v; }
    usleep(500);
  }
  printf("final word %llu; reaped: %d\n", v, waitpid(c, NULL, 0) == c);
  return 0;
}
