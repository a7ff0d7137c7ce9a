#include <cstdio>
int main() { std::puts("forge: under construction"); return 0; }
